"""Where a `farm tune`'s start-up goes on this machine, part by part, each in a fresh process.

    python bench/startup_parts.py [--workload resnet-last-conv] [--target cuda] [--repeats 3]

Each part runs as its own `python -c` process (cold, as `farm tune` meets it), `--repeats` times;
printed: the median and the spread of its seconds, measured inside the process (interpreter
start-up excluded; it is printed as its own part). The parts are the steps `farm tune` takes
before its first candidate is built: the interpreter, the farm's imports, nvidia-smi (GPU count),
TVM's import (as it comes, and as the farm's processes import it: without torch), the job's
checks (`farm submit` makes only these: no TVM), the local Ray instance
(`scheduler.cluster.init_ray`, then `stop_ray`; also without the workers Ray prestarts, one per
core), and a Ray actor that imports TVM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent

PARTS = {
    "interpreter": "pass",
    "farm imports": "import farm.cli, farm.client, farm.core.task, scheduler.service, workers.device",
    "nvidia-smi (GPU count)": "from farm.core.host import gpu_count; gpu_count()",
    "import tvm, as it comes (with torch where installed)": "import tvm",
    "import tvm as the farm does (farm.core.tvm_import)": "from farm.core.tvm_import import import_tvm; import_tvm()",
    "the job's checks (JobRequest.build: target, workload, space; no TVM)": (
        "from farm.core.jobspec import JobRequest; JobRequest.build([{wl!r}], {target!r}, 500)"),
    "ray start + stop": "from scheduler.cluster import init_ray, stop_ray; init_ray(); stop_ray()",
    "ray start + stop, no prestarted workers": (
        "import os; os.environ['RAY_enable_worker_prestart'] = '0'\n"
        "from scheduler.cluster import init_ray, stop_ray; init_ray(); stop_ray()"),
    "ray start + an actor importing TVM": (
        "import ray; from scheduler.cluster import init_ray, stop_ray; init_ray()\n"
        "@ray.remote\nclass A:\n    def __init__(self):\n"
        "        from farm.core.tvm_import import import_tvm; import_tvm()\n"
        "    def ok(self):\n        return 1\n"
        "ray.get(A.remote().ok.remote()); stop_ray()"),
}


def seconds(code: str) -> float:
    """Seconds `code` takes inside a fresh interpreter (its start-up for the "interpreter" part)."""
    timed = f"import time\n_t = time.perf_counter()\n{code}\nprint('SECONDS', time.perf_counter() - _t)"
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", timed], capture_output=True, text=True, cwd=_REPO, check=True).stdout
    inside = float(out.rsplit("SECONDS", 1)[1])
    return time.perf_counter() - start - inside if code == "pass" else inside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="resnet-last-conv")
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures = {}
    for name, code in PARTS.items():
        runs = [seconds(code.format(wl=args.workload, target=args.target)) for _ in range(args.repeats)]
        figures[name] = runs
        print(f"{name}: {statistics.median(runs):.2f} s (min {min(runs):.2f}, max {max(runs):.2f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
