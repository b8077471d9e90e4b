"""A microbenchmark, not part of the engine: the embedded target's prefill and decode step times
in one dtype, with the engine's batch-invariant kernels. Prefill of a random prompt of 32, 128,
500 and 1,000 tokens in one forward (median of 3 after a warm-up); after 200 tokens, plain steps
(median of 60) and 5-token forwards, a k = 4 verification (median of 12). Run it in two checkouts
alternately to compare kernels (BENCHMARKS.md, "a Xeon with AMX").

usage: .venv/bin/python tools/prefill_speed.py [DTYPE]   (prints one JSON object; DTYPE: bfloat16)
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from engine.kv import growing_cache
from engine.models import load_model

model = load_model("embedded", dtype=sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
gen = torch.Generator().manual_seed(0)
ms = lambda seconds: round(statistics.median(seconds) * 1000, 1)
result = {"dtype": str(model.dtype), "batch_invariant": model.batch_invariant, "prefill_ms": {}}
with torch.inference_mode():
    for n in (32, 128, 500, 1000):
        ids = torch.randint(0, model.vocab_size, (1, n), generator=gen)
        times = []
        for _ in range(4):
            cache, begin = growing_cache(), time.perf_counter()
            model.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - begin)
        result["prefill_ms"][n] = ms(times[1:])
    for name, width, count in (("step_ms", 1, 60), ("verify5_ms", 5, 12)):
        cache = growing_cache()
        model.model(input_ids=ids[:, :200], cache=cache, use_cache=True, logits_to_keep=1)
        times = []
        for i in range(200, 200 + width * count, width):
            begin = time.perf_counter()
            model.model(input_ids=ids[:, i:i + width], cache=cache, use_cache=True)
            times.append(time.perf_counter() - begin)
        result[name] = ms(times)
result["load_average"] = round(os.getloadavg()[0], 2)
print(json.dumps(result))
