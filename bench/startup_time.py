"""How long `isoserve serve` takes from its start to answering /health, for one or more
checkouts of isoserve in alternating rounds (this machine is shared and noisy: compare medians
taken in the same run, never numbers from different runs).

    python bench/startup_time.py --rounds 3 --checkout /path/to/older/isoserve -- --dtype auto

Each checkout runs from its own folder (`python -m` puts the working directory first on the
path) with it on PYTHONPATH too, which its workers inherit; all with this virtual environment.
A checkout whose kernel sources differ builds its kernels on its first start: run
`python -m isoserve.kernels` there first, or that build is what the first round measures.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from isoserve.bench.local_server import LocalServer, child_env, free_port, isoserve_cmd  # noqa: E402
from isoserve.server.tenants import add_tenant  # noqa: E402

POLL_S = 0.05


def time_to_healthy(checkout: Path, serve_args: list[str], tenants: Path, log_path: Path, timeout: float) -> float:
    port = free_port()
    cmd = isoserve_cmd("serve", "--port", str(port), "--tenants", str(tenants), *serve_args)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=checkout, start_new_session=True,
                                env={**child_env(), "PYTHONPATH": str(checkout)})
    server = LocalServer(proc, f"http://127.0.0.1:{port}", cmd, log_path)
    try:
        server.wait_healthy(timeout, poll_s=POLL_S)
        return time.monotonic() - start
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--checkout", type=Path, action="append", default=[],
                    help="another isoserve checkout to time (repeatable); this one always runs first")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("serve_args", nargs="*", help="after --: more `isoserve serve` arguments")
    args = ap.parse_args()
    checkouts = [HERE, *(c.resolve() for c in args.checkout)]
    work = Path(tempfile.mkdtemp(prefix="isoserve-startup-"))
    tenants = work / "tenants.toml"
    add_tenant(tenants, "bench")
    seconds: dict[Path, list[float]] = {c: [] for c in checkouts}
    runs = [(r, c) for r in range(args.rounds) for c in (checkouts if r % 2 == 0 else checkouts[::-1])]
    for r, checkout in tqdm(runs, desc="serve starts", unit="start"):
        log = work / f"serve-{r}-{len(seconds[checkout])}-{checkout.name}.log"
        seconds[checkout].append(time_to_healthy(checkout, ["--model", args.model, *args.serve_args],
                                                 tenants, log, args.timeout))
    first = statistics.median(seconds[HERE])
    print(f"isoserve serve --model {args.model} {' '.join(args.serve_args)}: start to /health 200, "
          f"{args.rounds} round(s), alternating order (logs in {work})")
    print("| checkout | median s | vs this checkout | rounds s |")
    print("|---|---:|---:|---|")
    for c, values in seconds.items():
        median = statistics.median(values)
        print(f"| {c} | {median:.2f} | {median / first:.2f}x | {', '.join(f'{v:.2f}' for v in values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
