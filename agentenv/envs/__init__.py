"""The shipped environments, registered on import of :mod:`agentenv`."""

from typing import Any

from agentenv.registration import register

QA_ENTRY_POINT = "agentenv.envs.qa:QAEnv"
MATH_ENTRY_POINT = "agentenv.envs.math:MathEnv"
WEB_ENTRY_POINT = "agentenv.envs.web:WebResearchEnv"

_OWN = "offline BM25 search over its own paragraphs; EM reward"
_POOLED = "BM25 over the pooled multi-hop paragraphs unless given corpus= or search=; EM reward"
_MATH = "sandboxed Python tool; math-verify equivalence reward"
_WEB_POOLED = "search + browse over an offline web of the pooled multi-hop paragraphs; F1 reward"
_WEB_OWN = "search + browse over an offline web of its own paragraphs; F1 reward"

#: (id, entry point, default kwargs, description), registered in this order.
_ENVIRONMENTS: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("multihop-qa", QA_ENTRY_POINT, {"dataset": "hotpotqa"}, f"HotpotQA dev 500, {_OWN}"),
    ("multihop-qa:hotpotqa", QA_ENTRY_POINT, {"dataset": "hotpotqa"}, f"HotpotQA dev 500, {_OWN}"),
    ("multihop-qa:2wiki", QA_ENTRY_POINT, {"dataset": "2wiki"}, f"2WikiMultihopQA dev 164, {_OWN}"),
    ("multihop-qa:musique", QA_ENTRY_POINT, {"dataset": "musique"}, f"MuSiQue dev 200, {_OWN}"),
    (
        "multihop-qa:pooled",
        QA_ENTRY_POINT,
        {"dataset": "multihop"},
        "HotpotQA dev 500, then 2WikiMultihopQA dev 164 and MuSiQue dev 200 (held out first, trained on after); "
        "BM25 over their pooled paragraphs; EM reward",
    ),
    ("multihop-qa:bamboogle", QA_ENTRY_POINT, {"dataset": "bamboogle"}, f"Bamboogle 125, {_POOLED}"),
    ("singlehop-qa", QA_ENTRY_POINT, {"dataset": "nq"}, f"NQ-open test 1k, {_POOLED}"),
    ("singlehop-qa:nq", QA_ENTRY_POINT, {"dataset": "nq"}, f"NQ-open test 1k, {_POOLED}"),
    ("singlehop-qa:triviaqa", QA_ENTRY_POINT, {"dataset": "triviaqa"}, f"TriviaQA test 1k, {_POOLED}"),
    ("singlehop-qa:popqa", QA_ENTRY_POINT, {"dataset": "popqa"}, f"PopQA test 1k, {_POOLED}"),
    ("python-math", MATH_ENTRY_POINT, {"dataset": "math500"}, f"MATH-500, {_MATH}"),
    ("python-math:math500", MATH_ENTRY_POINT, {"dataset": "math500"}, f"MATH-500, {_MATH}"),
    ("python-math:gsm8k", MATH_ENTRY_POINT, {"dataset": "gsm8k"}, f"GSM8K test 1319, {_MATH}"),
    (
        "python-math:arithmetic",
        "agentenv.envs.arithmetic:ArithmeticEnv",
        {},
        f"generated integer expressions, 500 held out then 1M to train on, {_MATH}",
    ),
    (
        "tool-qa",
        "agentenv.envs.qa:tool_qa",
        {"dataset": "hotpotqa"},
        "HotpotQA dev 500 with search and a sandboxed Python tool; AEPO's released reward (EM, F1 + 0.1 with both tools)",
    ),
    ("web-research", WEB_ENTRY_POINT, {"dataset": "bamboogle"}, f"Bamboogle 125, {_WEB_POOLED}"),
    ("web-research:bamboogle", WEB_ENTRY_POINT, {"dataset": "bamboogle"}, f"Bamboogle 125, {_WEB_POOLED}"),
    ("web-research:nq", WEB_ENTRY_POINT, {"dataset": "nq"}, f"NQ-open test 1k, {_WEB_POOLED}"),
    ("web-research:triviaqa", WEB_ENTRY_POINT, {"dataset": "triviaqa"}, f"TriviaQA test 1k, {_WEB_POOLED}"),
    ("web-research:popqa", WEB_ENTRY_POINT, {"dataset": "popqa"}, f"PopQA test 1k, {_WEB_POOLED}"),
    ("web-research:hotpotqa", WEB_ENTRY_POINT, {"dataset": "hotpotqa"}, f"HotpotQA dev 500, {_WEB_OWN}"),
    ("web-research:2wiki", WEB_ENTRY_POINT, {"dataset": "2wiki"}, f"2WikiMultihopQA dev 164, {_WEB_OWN}"),
    ("web-research:musique", WEB_ENTRY_POINT, {"dataset": "musique"}, f"MuSiQue dev 200, {_WEB_OWN}"),
)

for _id, _entry_point, _defaults, _description in _ENVIRONMENTS:
    register(_id, _entry_point, description=_description, **_defaults)
del _id, _entry_point, _defaults, _description
