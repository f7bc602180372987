/*
 * A fake libnvidia-ml.so.1 for tests: the unmodified pynvml loads it and calls it
 * exactly as it would call the real NVML.
 *
 * State comes from an inventory file named by $FAKE_NVML_INVENTORY; the file is
 * re-read whenever its identity, size or mtime changes, so a test can change
 * memory, processes, MIG state, lose a GPU or force return codes between calls.
 * Without the variable (or with an unreadable file) nvmlInit fails with
 * NVML_ERROR_DRIVER_NOT_LOADED, like a host without a driver.
 *
 * Inventory format: one `key=value` per line, `#` starts a comment.
 *   driver_version=550.54.15
 *   count=8                           (default: highest gpu index + 1)
 *   memory_v2_version=0x02000028      (the nvmlMemory_v2_t version this "driver" accepts)
 *   rc.<nvmlFunction>=<code>          force a return code for every call of the function
 *   gpu.<i>.name= / uuid= / bus_id=
 *   gpu.<i>.total= / reserved= / used= / free=   (bytes; free defaults to total-reserved-used)
 *   gpu.<i>.procs=<pid>:<bytes|na>[,<pid>:<bytes|na>...]
 *   gpu.<i>.lost=1                    every call on the device returns GPU_IS_LOST
 *   gpu.<i>.mig=1 / mig_pending=1 / max_mig=<n>
 *   gpu.<i>.rc.<nvmlFunction>=<code>  forced return code for this device only
 *   gpu.<i>.mig.<m>.<key>=...         a MIG device (same keys as a GPU except mig*)
 * v1 memory reports used = reserved + used (v1 has no reserved field), as the real one.
 *
 * Exported for tests: int fake_nvml_init_calls, fake_nvml_reloads.
 */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_GPUS 16
#define MAX_MIG 8
#define MAX_PROCS 64
#define MAX_RC 64

enum {
    OK = 0, ERR_UNINITIALIZED = 1, ERR_INVALID_ARGUMENT = 2, ERR_NOT_SUPPORTED = 3,
    ERR_NOT_FOUND = 6, ERR_INSUFFICIENT_SIZE = 7, ERR_DRIVER_NOT_LOADED = 9,
    ERR_GPU_IS_LOST = 15, ERR_ARGUMENT_VERSION_MISMATCH = 25, ERR_UNKNOWN = 999
};

/* ------------------------------------------------------------ C shapes of NVML */
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct {
    unsigned int pid; unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct {
    char busIdLegacy[16]; unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t is 24 bytes");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t is 40 bytes");
_Static_assert(offsetof(nvmlMemory_v2_t, total) == 8, "nvmlMemory_v2_t.total at 8");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t (v3 in nvidia-ml-py 13.x) is 24 bytes");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t is 68 bytes");

#define NVML_MEMORY_V2_VERSION (unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24))
#define NA_U64 0xFFFFFFFFFFFFFFFFULL
#define NA_U32 0xFFFFFFFFu

/* ------------------------------------------------------------ inventory */
typedef struct { unsigned int pid; unsigned long long used; } fproc;

typedef struct {
    int present;
    char name[96], uuid[96], bus_id[32];
    unsigned long long total, reserved, used, free;
    int free_set, lost, mig, mig_pending, max_mig;
    fproc procs[MAX_PROCS];
    int nprocs;
} fdev;

typedef struct { int gpu, mig; char func[64]; int code; } frc; /* gpu -1: any; mig -1: parent */

typedef struct { int gpu, mig; } fhandle; /* what an nvmlDevice_t points at */

static struct {
    int valid;
    char driver[80];
    int count, count_set;
    unsigned int mem_v2_version;
    fdev gpus[MAX_GPUS];
    fdev migs[MAX_GPUS][MAX_MIG];
    frc rcs[MAX_RC];
    int nrc;
} inv;

static fhandle handles[MAX_GPUS][MAX_MIG + 1];
static int init_refcount;
static struct stat last_stat;
static char last_path[4096];

int fake_nvml_init_calls;
int fake_nvml_reloads;

static void copy_str(char *dst, size_t size, const char *src) {
    snprintf(dst, size, "%s", src);
}

static int parse_procs(fdev *d, const char *value) {
    d->nprocs = 0;
    const char *p = value;
    while (*p) {
        if (d->nprocs >= MAX_PROCS) return -1;
        char *end;
        unsigned long pid = strtoul(p, &end, 10);
        if (end == p || *end != ':') return -1;
        p = end + 1;
        unsigned long long used;
        if (strncmp(p, "na", 2) == 0) { used = NA_U64; p += 2; }
        else { used = strtoull(p, &end, 10); if (end == p) return -1; p = end; }
        d->procs[d->nprocs].pid = (unsigned int)pid;
        d->procs[d->nprocs].used = used;
        d->nprocs++;
        if (*p == ',') p++;
        else if (*p) return -1;
    }
    return 0;
}

static int add_rc(int gpu, int mig, const char *func, const char *value) {
    if (inv.nrc >= MAX_RC || strlen(func) >= sizeof(inv.rcs[0].func)) return -1;
    frc *r = &inv.rcs[inv.nrc++];
    r->gpu = gpu; r->mig = mig;
    copy_str(r->func, sizeof r->func, func);
    r->code = (int)strtol(value, NULL, 0);
    return 0;
}

static int set_dev_key(fdev *d, int gpu, int mig, const char *key, const char *value) {
    d->present = 1;
    if (strncmp(key, "rc.", 3) == 0) return add_rc(gpu, mig, key + 3, value);
    if (strcmp(key, "name") == 0) copy_str(d->name, sizeof d->name, value);
    else if (strcmp(key, "uuid") == 0) copy_str(d->uuid, sizeof d->uuid, value);
    else if (strcmp(key, "bus_id") == 0) copy_str(d->bus_id, sizeof d->bus_id, value);
    else if (strcmp(key, "total") == 0) d->total = strtoull(value, NULL, 0);
    else if (strcmp(key, "reserved") == 0) d->reserved = strtoull(value, NULL, 0);
    else if (strcmp(key, "used") == 0) d->used = strtoull(value, NULL, 0);
    else if (strcmp(key, "free") == 0) { d->free = strtoull(value, NULL, 0); d->free_set = 1; }
    else if (strcmp(key, "lost") == 0) d->lost = atoi(value);
    else if (strcmp(key, "procs") == 0) return parse_procs(d, value);
    else if (mig < 0 && strcmp(key, "mig") == 0) d->mig = atoi(value);
    else if (mig < 0 && strcmp(key, "mig_pending") == 0) d->mig_pending = atoi(value);
    else if (mig < 0 && strcmp(key, "max_mig") == 0) d->max_mig = atoi(value);
    else return -1;
    return 0;
}

static int set_key(const char *key, const char *value) {
    if (strcmp(key, "driver_version") == 0) { copy_str(inv.driver, sizeof inv.driver, value); return 0; }
    if (strcmp(key, "count") == 0) { inv.count = atoi(value); inv.count_set = 1; return 0; }
    if (strcmp(key, "memory_v2_version") == 0) { inv.mem_v2_version = (unsigned int)strtoul(value, NULL, 0); return 0; }
    if (strncmp(key, "rc.", 3) == 0) return add_rc(-1, -1, key + 3, value);
    if (strncmp(key, "gpu.", 4) != 0) return -1;
    char *end;
    long gpu = strtol(key + 4, &end, 10);
    if (end == key + 4 || *end != '.' || gpu < 0 || gpu >= MAX_GPUS) return -1;
    const char *rest = end + 1;
    if (strncmp(rest, "mig.", 4) == 0 && rest[4] >= '0' && rest[4] <= '9') {
        long mig = strtol(rest + 4, &end, 10);
        if (*end != '.' || mig < 0 || mig >= MAX_MIG) return -1;
        inv.gpus[gpu].present = 1;
        return set_dev_key(&inv.migs[gpu][mig], (int)gpu, (int)mig, end + 1, value);
    }
    return set_dev_key(&inv.gpus[gpu], (int)gpu, -1, rest, value);
}

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    size_t n = strlen(s);
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\n' || s[n - 1] == '\r')) s[--n] = 0;
    return s;
}

static void load(const char *path) {
    memset(&inv, 0, sizeof inv);
    inv.mem_v2_version = NVML_MEMORY_V2_VERSION;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[4096];
    int lineno = 0, ok = 1;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *s = trim(line);
        if (!*s) continue;
        char *eq = strchr(s, '=');
        if (!eq) { ok = 0; fprintf(stderr, "fake_nvml: %s:%d: expected key=value\n", path, lineno); continue; }
        *eq = 0;
        char *key = trim(s), *value = trim(eq + 1);
        if (set_key(key, value) != 0) {
            ok = 0;
            fprintf(stderr, "fake_nvml: %s:%d: bad key or value: %s=%s\n", path, lineno, key, value);
        }
    }
    fclose(f);
    if (!inv.count_set) {
        inv.count = 0;
        for (int i = 0; i < MAX_GPUS; i++) if (inv.gpus[i].present) inv.count = i + 1;
    }
    if (inv.count > MAX_GPUS) inv.count = MAX_GPUS;
    for (int g = 0; g < MAX_GPUS; g++) {
        fdev *d = &inv.gpus[g];
        if (!d->name[0]) copy_str(d->name, sizeof d->name, "Fake GPU");
        if (!d->uuid[0]) snprintf(d->uuid, sizeof d->uuid, "GPU-fake-%04d", g);
        if (!d->bus_id[0]) snprintf(d->bus_id, sizeof d->bus_id, "00000000:%02X:00.0", g + 1);
        if (!d->free_set) d->free = d->total - d->reserved - d->used;
        for (int m = 0; m < MAX_MIG; m++) {
            fdev *md = &inv.migs[g][m];
            if (!md->name[0]) snprintf(md->name, sizeof md->name, "%s MIG", d->name);
            if (!md->uuid[0]) snprintf(md->uuid, sizeof md->uuid, "MIG-fake-%04d-%d", g, m);
            if (!md->free_set) md->free = md->total - md->reserved - md->used;
        }
        if (d->max_mig == 0 && d->mig) d->max_mig = MAX_MIG;
    }
    inv.valid = ok;
    fake_nvml_reloads++;
}

/* Re-read the inventory when the variable or the file changed. */
static void refresh(void) {
    const char *path = getenv("FAKE_NVML_INVENTORY");
    if (!path || !*path) { inv.valid = 0; last_path[0] = 0; return; }
    struct stat st;
    if (stat(path, &st) != 0) { inv.valid = 0; last_path[0] = 0; return; }
    if (strcmp(path, last_path) == 0 && st.st_dev == last_stat.st_dev && st.st_ino == last_stat.st_ino &&
        st.st_size == last_stat.st_size && st.st_mtim.tv_sec == last_stat.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == last_stat.st_mtim.tv_nsec)
        return;
    copy_str(last_path, sizeof last_path, path);
    last_stat = st;
    load(path);
}

static int forced_rc(const char *func, int gpu, int mig) {
    for (int i = 0; i < inv.nrc; i++) {
        frc *r = &inv.rcs[i];
        if (strcmp(r->func, func) != 0) continue;
        if (r->gpu == -1 || (r->gpu == gpu && r->mig == mig)) return r->code;
    }
    return OK;
}

/* Common entry of system calls: refreshed, initialised, forced code. */
static int enter(const char *func) {
    refresh();
    if (init_refcount == 0) return ERR_UNINITIALIZED;
    if (!inv.valid) return ERR_UNKNOWN;
    return forced_rc(func, -1, -1);
}

/* Common entry of device calls; sets *out to the device the handle names. */
static int enter_dev(const char *func, const void *handle, fdev **out, fhandle **h_out) {
    int rc = enter(func);
    if (rc) return rc;
    const fhandle *h = handle;
    const fhandle *first = &handles[0][0], *last = &handles[MAX_GPUS - 1][MAX_MIG];
    if (h < first || h > last) return ERR_INVALID_ARGUMENT;
    if (h->gpu >= inv.count) return ERR_INVALID_ARGUMENT;
    fdev *d = h->mig < 0 ? &inv.gpus[h->gpu] : &inv.migs[h->gpu][h->mig];
    if (inv.gpus[h->gpu].lost || d->lost) return ERR_GPU_IS_LOST;
    if ((rc = forced_rc(func, h->gpu, h->mig))) return rc;
    *out = d;
    if (h_out) *h_out = (fhandle *)h;
    return OK;
}

static int copy_out(char *buf, unsigned int len, const char *value) {
    if (!buf) return ERR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > len) return ERR_INSUFFICIENT_SIZE;
    memcpy(buf, value, strlen(value) + 1);
    return OK;
}

/* ------------------------------------------------------------ the API */
static int do_init(const char *func) {
    fake_nvml_init_calls++;
    refresh();
    if (!inv.valid) return ERR_DRIVER_NOT_LOADED;
    int rc = forced_rc(func, -1, -1);
    if (rc) return rc;
    init_refcount++;
    return OK;
}

int nvmlInitWithFlags(unsigned int flags) { (void)flags; return do_init("nvmlInitWithFlags"); }
int nvmlInit_v2(void) { return do_init("nvmlInit_v2"); }
int nvmlInit(void) { return do_init("nvmlInit"); }

int nvmlShutdown(void) {
    if (init_refcount == 0) return ERR_UNINITIALIZED;
    refresh();
    int rc = forced_rc("nvmlShutdown", -1, -1);
    if (rc) return rc;
    init_refcount--;
    return OK;
}

const char *nvmlErrorString(int result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 15: return "GPU is lost";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    int rc = enter("nvmlSystemGetDriverVersion");
    return rc ? rc : copy_out(version, length, inv.driver[0] ? inv.driver : "550.54.15");
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    int rc = enter("nvmlDeviceGetCount_v2");
    if (rc) return rc;
    if (!count) return ERR_INVALID_ARGUMENT;
    *count = (unsigned int)inv.count;
    return OK;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    int rc = enter("nvmlDeviceGetHandleByIndex_v2");
    if (rc) return rc;
    if (!device || index >= (unsigned int)inv.count) return ERR_INVALID_ARGUMENT;
    if ((rc = forced_rc("nvmlDeviceGetHandleByIndex_v2", (int)index, -1))) return rc;
    handles[index][0].gpu = (int)index;
    handles[index][0].mig = -1;
    *device = &handles[index][0];
    return OK;
}

int nvmlDeviceGetIndex(void *device, unsigned int *index) {
    fdev *d; fhandle *h;
    int rc = enter_dev("nvmlDeviceGetIndex", device, &d, &h);
    if (rc) return rc;
    *index = (unsigned int)h->gpu;
    return OK;
}

int nvmlDeviceGetName(void *device, char *name, unsigned int length) {
    fdev *d;
    int rc = enter_dev("nvmlDeviceGetName", device, &d, NULL);
    return rc ? rc : copy_out(name, length, d->name);
}

int nvmlDeviceGetUUID(void *device, char *uuid, unsigned int length) {
    fdev *d;
    int rc = enter_dev("nvmlDeviceGetUUID", device, &d, NULL);
    return rc ? rc : copy_out(uuid, length, d->uuid);
}

int nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *memory) {
    fdev *d;
    int rc = enter_dev("nvmlDeviceGetMemoryInfo", device, &d, NULL);
    if (rc) return rc;
    if (!memory) return ERR_INVALID_ARGUMENT;
    memory->total = d->total;
    memory->free = d->free;
    memory->used = d->used + d->reserved; /* v1 counts the driver's reservation as used */
    return OK;
}

int nvmlDeviceGetMemoryInfo_v2(void *device, nvmlMemory_v2_t *memory) {
    fdev *d;
    int rc = enter_dev("nvmlDeviceGetMemoryInfo_v2", device, &d, NULL);
    if (rc) return rc;
    if (!memory) return ERR_INVALID_ARGUMENT;
    if (memory->version != inv.mem_v2_version) return ERR_ARGUMENT_VERSION_MISMATCH;
    memory->total = d->total;
    memory->reserved = d->reserved;
    memory->free = d->free;
    memory->used = d->used;
    return OK;
}

#ifndef FAKE_NVML_NO_PROCESSES_V3
int nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *count, nvmlProcessInfo_t *infos) {
    fdev *d; fhandle *h;
    int rc = enter_dev("nvmlDeviceGetComputeRunningProcesses_v3", device, &d, &h);
    if (rc) return rc;
    if (!count) return ERR_INVALID_ARGUMENT;
    unsigned int n = (unsigned int)d->nprocs;
    if (*count < n || (n && !infos)) { *count = n; return ERR_INSUFFICIENT_SIZE; }
    for (unsigned int i = 0; i < n; i++) {
        infos[i].pid = d->procs[i].pid;
        infos[i].usedGpuMemory = d->procs[i].used;
        infos[i].gpuInstanceId = h->mig < 0 ? NA_U32 : (unsigned int)h->mig;
        infos[i].computeInstanceId = h->mig < 0 ? NA_U32 : 0;
    }
    *count = n;
    return OK;
}
#endif

int nvmlDeviceGetPciInfo_v3(void *device, nvmlPciInfo_t *pci) {
    fdev *d; fhandle *h;
    int rc = enter_dev("nvmlDeviceGetPciInfo_v3", device, &d, &h);
    if (rc) return rc;
    if (!pci) return ERR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    const char *bus = inv.gpus[h->gpu].bus_id;
    copy_str(pci->busIdLegacy, sizeof pci->busIdLegacy, bus);
    copy_str(pci->busId, sizeof pci->busId, bus);
    pci->bus = (unsigned int)h->gpu + 1;
    pci->pciDeviceId = 0x233010DE;
    return OK;
}

int nvmlDeviceGetMigMode(void *device, unsigned int *current, unsigned int *pending) {
    fdev *d; fhandle *h;
    int rc = enter_dev("nvmlDeviceGetMigMode", device, &d, &h);
    if (rc) return rc;
    if (h->mig >= 0) return ERR_NOT_SUPPORTED;
    if (!current || !pending) return ERR_INVALID_ARGUMENT;
    *current = (unsigned int)d->mig;
    *pending = (unsigned int)(d->mig_pending ? d->mig_pending : d->mig);
    return OK;
}

int nvmlDeviceGetMaxMigDeviceCount(void *device, unsigned int *count) {
    fdev *d; fhandle *h;
    int rc = enter_dev("nvmlDeviceGetMaxMigDeviceCount", device, &d, &h);
    if (rc) return rc;
    if (!count) return ERR_INVALID_ARGUMENT;
    *count = h->mig < 0 ? (unsigned int)d->max_mig : 0;
    return OK;
}

int nvmlDeviceGetMigDeviceHandleByIndex(void *device, unsigned int index, void **mig_device) {
    fdev *d; fhandle *h;
    int rc = enter_dev("nvmlDeviceGetMigDeviceHandleByIndex", device, &d, &h);
    if (rc) return rc;
    if (h->mig >= 0 || !d->mig) return ERR_NOT_SUPPORTED;
    if (!mig_device || index >= (unsigned int)d->max_mig || index >= MAX_MIG) return ERR_INVALID_ARGUMENT;
    if (!inv.migs[h->gpu][index].present) return ERR_NOT_FOUND;
    handles[h->gpu][index + 1].gpu = h->gpu;
    handles[h->gpu][index + 1].mig = (int)index;
    *mig_device = &handles[h->gpu][index + 1];
    return OK;
}

int nvmlDeviceIsMigDeviceHandle(void *device, unsigned int *is_mig) {
    fdev *d; fhandle *h;
    int rc = enter_dev("nvmlDeviceIsMigDeviceHandle", device, &d, &h);
    if (rc) return rc;
    if (!is_mig) return ERR_INVALID_ARGUMENT;
    *is_mig = h->mig >= 0;
    return OK;
}

int nvmlDeviceGetDeviceHandleFromMigDeviceHandle(void *mig_device, void **device) {
    fdev *d; fhandle *h;
    int rc = enter_dev("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", mig_device, &d, &h);
    if (rc) return rc;
    if (h->mig < 0) return ERR_INVALID_ARGUMENT;
    handles[h->gpu][0].gpu = h->gpu;
    handles[h->gpu][0].mig = -1;
    *device = &handles[h->gpu][0];
    return OK;
}
