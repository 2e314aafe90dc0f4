"""The golden greedy continuation of aidreams260K-q4_0 and the rule for comparing with it.

Rule (shared/golden/README.md, tests/test_golden.cpp): greedy ids must equal the reference
up to the first step whose reference top-1 margin is within the Q4_0 logit tolerance
(2e-2 x max|logit|); past it the two may legitimately part. When all 64 ids agree (the case
today) the text must equal greedy_text exactly.

Also a command for scripts/test-ffi:  python3 golden.py FILE  checks a file whose first
line is the generated ids (space-separated) and the rest the generated text.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def shared_dir() -> str:
    env = os.environ.get("TANDEM_SHARED")
    if env:
        return env
    return os.path.normpath(os.path.join(HERE, "..", "..", "..", "..", "..", "shared"))


def model_path() -> str:
    models = os.environ.get("TANDEM_MODELS") or os.path.join(shared_dir(), "models")
    return os.path.join(models, "aidreams260K-q4_0.gguf")


def load_case(name: str = "once_upon") -> dict:
    with open(os.path.join(shared_dir(), "golden", "aidreams260K-q4_0", "cases.json"), encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    return next(c for c in cases if c["name"] == name)


def clear_prefix(case: dict) -> int:
    tol = 2e-2 * case["logits_max_abs"]
    n = 0
    for m in case["greedy_top1_margin"]:
        if m <= tol:
            break
        n += 1
    return n


def check(case: dict, ids, text: str) -> str:
    """Raise AssertionError unless (ids, text) agree with the golden continuation."""
    ref = case["greedy_ids"]
    ids = list(ids)
    assert len(ids) == len(ref), f"{len(ids)} ids generated, {len(ref)} expected"
    clear = clear_prefix(case)
    assert ids[:clear] == ref[:clear], f"ids {ids[:clear]} != golden {ref[:clear]} (first {clear} steps)"
    same = 0
    while same < len(ref) and ids[same] == ref[same]:
        same += 1
    if same == len(ref):
        assert text == case["greedy_text"], f"text {text!r} != golden {case['greedy_text']!r}"
    return f"{same} of {len(ref)} greedy ids equal the golden continuation ({clear} required)"


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        first, _, rest = f.read().partition("\n")
    print(check(load_case(sys.argv[2] if len(sys.argv) > 2 else "once_upon"), [int(x) for x in first.split()], rest))
