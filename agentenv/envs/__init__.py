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
