// The cache lab page. Reset fetches one run of kvledger.tools.lab.run_lab (lab/run.json: per step the
// identifier requested, hit or miss, the identifier evicted and the running totals), so every
// number shown comes from the code behind `kvledger lab`; Step and Play only replay that run,
// putting each identifier into a drawn slot.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const capacityInput = $("capacity");
  const idsInput = $("ids");
  const predictionInput = $("prediction");
  const resetButton = $("reset");
  const stepButton = $("step");
  const playButton = $("play");
  const speedSelect = $("speed");
  const message = $("message");
  const slotsBox = $("slots");
  const historyBox = $("history");
  const HISTORY = 64;
  // steps per tick and milliseconds between ticks
  const SPEEDS = { slow: [1, 250], medium: [1, 40], fast: [16, 30], max: [256, 0] };

  let run = null; // the run document of the latest Reset
  let ready = Promise.resolve();
  let generation = 0;
  let n = 0; // requests replayed
  let slots = []; // identifier per slot, null when empty
  let lastUsed = []; // request number of the latest use per slot
  let slotOf = new Map();
  let filled = 0;
  let touched = -1; // the slot of the latest request
  let playing = false;
  let timer = null;

  function setMessage(text, isError) {
    message.textContent = text;
    message.className = isError ? "message error" : "message";
  }

  function readInt(input, name) {
    const v = Number(input.value);
    const lo = Number(input.min);
    const hi = Number(input.max);
    if (input.value.trim() === "" || !Number.isInteger(v) || v < lo || v > hi) {
      throw new Error(`${name} must be a whole number from ${lo} to ${hi}`);
    }
    return v;
  }

  function stopPlaying() {
    playing = false;
    if (timer !== null) clearTimeout(timer);
    timer = null;
    playButton.textContent = "Play";
  }

  function updateButtons() {
    const done = run === null || n >= run.requests;
    stepButton.disabled = done;
    playButton.disabled = done && !playing;
  }

  function reset() {
    stopPlaying();
    generation += 1;
    const mine = generation;
    let capacity, ids;
    try {
      capacity = readInt(capacityInput, "capacity C");
      ids = readInt(idsInput, "identifiers S");
    } catch (err) {
      run = null;
      n = 0;
      drawAll();
      setMessage(err.message, true);
      updateButtons();
      ready = Promise.resolve();
      return ready;
    }
    run = null;
    n = 0;
    slots = new Array(capacity).fill(null);
    lastUsed = new Array(capacity).fill(0);
    slotOf = new Map();
    filled = 0;
    touched = -1;
    drawAll();
    setMessage("");
    updateButtons();
    ready = fetch(`lab/run.json?capacity=${capacity}&working_set=${ids}`, { cache: "no-store", credentials: "same-origin" })
      .then(async (response) => {
        const doc = await response.json();
        if (!response.ok) throw new Error(doc.error || `HTTP ${response.status}`);
        return doc;
      })
      .then((doc) => {
        if (mine !== generation) return;
        run = doc;
        $("cap").textContent = doc.max_requests.toLocaleString("en-US");
        setMessage(`Reset: C=${capacity}, S=${ids}. Predict, then Step or Play.`);
        drawAll();
        updateButtons();
      })
      .catch((err) => {
        if (mine !== generation) return;
        setMessage(`Cannot run the lab: ${err.message}`, true);
      });
    return ready;
  }

  // Replay up to k steps of the run: put each requested identifier into its slot.
  function advance(k) {
    if (run === null) return;
    const steps = run.steps;
    const end = Math.min(run.requests, n + k);
    for (let i = n; i < end; i++) {
      const key = steps.key[i];
      let slot;
      if (steps.hit[i]) {
        slot = slotOf.get(key);
      } else {
        const evicted = steps.evicted[i];
        if (evicted !== null) {
          slot = slotOf.get(evicted);
          slotOf.delete(evicted);
        } else {
          slot = filled;
          filled += 1;
        }
        slots[slot] = key;
        slotOf.set(key, slot);
      }
      if (slot === undefined || slot >= slots.length) {
        setMessage(`the run and the drawing disagree at request ${i + 1}`, true);
        stopPlaying();
        return;
      }
      lastUsed[slot] = i + 1;
      touched = slot;
    }
    n = end;
    drawAll();
    describeLatest();
    updateButtons();
  }

  function describeLatest() {
    if (run === null || n === 0) return;
    const i = n - 1;
    const s = run.steps;
    let text = `Request ${n}: identifier ${s.key[i]}, ${s.hit[i] ? "hit" : "miss"}`;
    if (!s.hit[i]) text += s.evicted[i] === null ? " (a free slot took it)" : `, evicted ${s.evicted[i]}`;
    text += ".";
    const predicted = predictionInput.value.trim();
    if (n >= 16 && predicted !== "") {
      text += ` You predicted ${predicted} hits in the first 16 requests; there were ${s.hits[15]}.`;
    }
    if (n >= run.requests) text += ` The run stops at its cap of ${run.requests.toLocaleString("en-US")} requests.`;
    setMessage(text);
  }

  function drawAll() {
    const s = run ? run.steps : null;
    $("requests").textContent = String(n);
    $("hits").textContent = String(n && s ? s.hits[n - 1] : 0);
    $("misses").textContent = String(n && s ? s.misses[n - 1] : 0);
    $("evictions").textContent = String(n && s ? s.evictions[n - 1] : 0);
    const full = filled === slots.length && slots.length > 0;
    let victim = -1;
    if (full) {
      victim = 0;
      for (let j = 1; j < slots.length; j++) if (lastUsed[j] < lastUsed[victim]) victim = j;
    }
    const hit = s && n ? s.hit[n - 1] : false;
    slotsBox.replaceChildren(...slots.map((key, j) => {
      const node = document.createElement("div");
      node.className = "slot" + (key === null ? " empty" : "") + (j === touched ? (hit ? " hit" : " miss") : "")
        + (j === victim ? " victim" : "");
      node.dataset.slot = String(j);
      node.dataset.key = key === null ? "" : String(key);
      const k = document.createElement("span");
      k.className = "key";
      k.textContent = key === null ? "\u2013" : String(key);
      const age = document.createElement("span");
      age.className = "age";
      age.textContent = key === null ? "empty" : `used at ${lastUsed[j]}`;
      node.append(k, age);
      return node;
    }));
    const cells = [];
    if (s) {
      for (let i = Math.max(0, n - HISTORY); i < n; i++) {
        const c = document.createElement("span");
        c.className = `cell ${s.hit[i] ? "hit" : "miss"}`;
        c.textContent = String(s.key[i]);
        c.title = `request ${i + 1}: ${s.key[i]} ${s.hit[i] ? "hit" : "miss"}`;
        cells.push(c);
      }
    }
    historyBox.replaceChildren(...cells);
  }

  function tick() {
    timer = null;
    if (!playing) return;
    const [batch, delay] = SPEEDS[speedSelect.value] || SPEEDS.medium;
    advance(batch);
    if (run === null || n >= run.requests) {
      stopPlaying();
      updateButtons();
      return;
    }
    timer = setTimeout(tick, delay);
  }

  stepButton.addEventListener("click", () => {
    const mine = generation;
    ready = ready.then(() => { if (mine === generation) advance(1); });
  });
  playButton.addEventListener("click", () => {
    if (playing) {
      stopPlaying();
      updateButtons();
      return;
    }
    const mine = generation;
    playing = true;
    playButton.textContent = "Pause";
    ready = ready.then(() => { if (mine === generation && playing) tick(); });
  });
  resetButton.addEventListener("click", reset);
  capacityInput.addEventListener("change", reset);
  idsInput.addEventListener("change", reset);
  predictionInput.addEventListener("change", describeLatest);

  const params = new URLSearchParams(window.location.search);
  if (params.has("capacity")) capacityInput.value = params.get("capacity");
  if (params.has("working_set")) idsInput.value = params.get("working_set");
  reset();
})();
