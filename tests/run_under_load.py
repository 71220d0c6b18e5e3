"""Run pytest on the given tests with busy-loop processes beside it, several times: ``make test-load``.

Tests must wait on events and conditions, with timeouts that scale with load, not on fixed sleeps; this is
how that is checked. Exits non-zero at the first failing repetition.

    python tests/run_under_load.py --busy 2 --repeat 3 tests/service
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the tests")
    parser.add_argument("--repeat", type=int, default=3, help="runs that must pass in a row")
    parser.add_argument("pytest_args", nargs="+", help="what to pass to pytest")
    args = parser.parse_args()
    for attempt in range(1, args.repeat + 1):
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        started = time.monotonic()
        try:
            code = subprocess.call(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.pytest_args]
            )
        finally:
            for process in busy:
                process.kill()
                process.wait()
        print(
            f"test-load run {attempt}/{args.repeat}: exit {code} in {time.monotonic() - started:.0f} s",
            flush=True,
        )
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
