"""The shipped environments, registered on import of :mod:`agentenv`."""

from agentenv.registration import register

QA_ENTRY_POINT = "agentenv.envs.qa:QAEnv"
_OWN = "offline BM25 search over its own paragraphs; EM reward"
_POOLED = "BM25 over the pooled multi-hop paragraphs unless given corpus= or search=; EM reward"

register("multihop-qa", QA_ENTRY_POINT, dataset="hotpotqa", description=f"HotpotQA dev 500, {_OWN}")
register("multihop-qa:hotpotqa", QA_ENTRY_POINT, dataset="hotpotqa", description=f"HotpotQA dev 500, {_OWN}")
register("multihop-qa:2wiki", QA_ENTRY_POINT, dataset="2wiki", description=f"2WikiMultihopQA dev 164, {_OWN}")
register("multihop-qa:musique", QA_ENTRY_POINT, dataset="musique", description=f"MuSiQue dev 200, {_OWN}")
register("multihop-qa:bamboogle", QA_ENTRY_POINT, dataset="bamboogle", description=f"Bamboogle 125, {_POOLED}")
register("singlehop-qa", QA_ENTRY_POINT, dataset="nq", description=f"NQ-open test 1k, {_POOLED}")
register("singlehop-qa:nq", QA_ENTRY_POINT, dataset="nq", description=f"NQ-open test 1k, {_POOLED}")
register("singlehop-qa:triviaqa", QA_ENTRY_POINT, dataset="triviaqa", description=f"TriviaQA test 1k, {_POOLED}")
register("singlehop-qa:popqa", QA_ENTRY_POINT, dataset="popqa", description=f"PopQA test 1k, {_POOLED}")

MATH_ENTRY_POINT = "agentenv.envs.math:MathEnv"
_MATH = "sandboxed Python tool; math-verify equivalence reward"
register("python-math", MATH_ENTRY_POINT, dataset="math500", description=f"MATH-500, {_MATH}")
register("python-math:math500", MATH_ENTRY_POINT, dataset="math500", description=f"MATH-500, {_MATH}")
register("python-math:gsm8k", MATH_ENTRY_POINT, dataset="gsm8k", description=f"GSM8K test 1319, {_MATH}")
register("tool-qa", "agentenv.envs.qa:tool_qa", dataset="hotpotqa",
         description="HotpotQA dev 500 with search and a sandboxed Python tool; AEPO reward (F1, tool bonus)")

WEB_ENTRY_POINT = "agentenv.envs.web:WebResearchEnv"
_WEB_POOLED = "search + browse over an offline web of the pooled multi-hop paragraphs; F1 reward"
_WEB_OWN = "search + browse over an offline web of its own paragraphs; F1 reward"
register("web-research", WEB_ENTRY_POINT, dataset="bamboogle", description=f"Bamboogle 125, {_WEB_POOLED}")
register("web-research:bamboogle", WEB_ENTRY_POINT, dataset="bamboogle", description=f"Bamboogle 125, {_WEB_POOLED}")
register("web-research:nq", WEB_ENTRY_POINT, dataset="nq", description=f"NQ-open test 1k, {_WEB_POOLED}")
register("web-research:triviaqa", WEB_ENTRY_POINT, dataset="triviaqa", description=f"TriviaQA test 1k, {_WEB_POOLED}")
register("web-research:popqa", WEB_ENTRY_POINT, dataset="popqa", description=f"PopQA test 1k, {_WEB_POOLED}")
register("web-research:hotpotqa", WEB_ENTRY_POINT, dataset="hotpotqa", description=f"HotpotQA dev 500, {_WEB_OWN}")
register("web-research:2wiki", WEB_ENTRY_POINT, dataset="2wiki", description=f"2WikiMultihopQA dev 164, {_WEB_OWN}")
register("web-research:musique", WEB_ENTRY_POINT, dataset="musique", description=f"MuSiQue dev 200, {_WEB_OWN}")
