#: the clip of one request's remaining output in the admission estimate
CLIP_MAX_NEW_TOKENS = 4096
