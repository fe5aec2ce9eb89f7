"""Cold start of a dummy-weight model (a GPU run's, where the embedded
model's wheel does not travel): this process's start to ``open_engine()``
ready and to the first token of a token-id prompt, and the start-up spans of
both processes.

    python3 benchmarks/studies/startup/startup_dummy.py --model llama-8b [--log-json FILE]
"""

from __future__ import annotations

import argparse
import time

from asyncstep.logging.spans import process_start_us

START_US = process_start_us()


def main() -> None:
    import trio

    import asyncstep
    from asyncstep.logging import configure_logging

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--log-json")
    args = ap.parse_args()
    if args.log_json:
        configure_logging("info", args.log_json)

    def since_start() -> float:
        return time.time() - START_US / 1e6

    async def run() -> None:
        options = {"load_format": "dummy"}
        if args.log_json:
            options |= {"rank_log_json": args.log_json, "rank_log_level": "info"}
        async with asyncstep.open_engine(args.model, **options) as engine:
            print(f"ready {since_start():.2f} s", flush=True)
            params = asyncstep.SamplingParams(temperature=0, max_tokens=4)
            async for _ in engine.stream(list(range(1, 33)), params):
                print(f"first token {since_start():.2f} s", flush=True)
                break

    trio.run(run)


if __name__ == "__main__":
    main()
