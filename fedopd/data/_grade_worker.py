"""The grading worker process: reads JSON requests on stdin, answers on stdout (one per line)."""

import json
import sys

from fedopd.data.grading import verify_boxed


def main() -> None:
    import math_verify  # noqa: F401 - import before saying ready, so start-up is not a request's cost

    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            correct = verify_boxed(request["pred"], request["gold"], request["timeout"])
        except Exception:  # noqa: BLE001 - an unparsable answer is a wrong answer
            correct = False
        out.write(json.dumps({"correct": correct}).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
