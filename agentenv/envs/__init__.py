"""The shipped environments, registered on import of :mod:`agentenv`."""

from agentenv.registration import register

QA_ENTRY_POINT = "agentenv.envs.qa:QAEnv"

register("multihop-qa", QA_ENTRY_POINT, dataset="hotpotqa",
         description="HotpotQA dev (500) with offline BM25 search over its paragraphs; EM reward")
for _name in ("hotpotqa", "2wiki", "musique", "bamboogle"):
    register(f"multihop-qa:{_name}", QA_ENTRY_POINT, dataset=_name,
             description=f"{_name} with offline BM25 search; EM reward")
register("singlehop-qa", QA_ENTRY_POINT, dataset="nq",
         description="NQ-open (1k) searching the pooled multi-hop corpus; EM reward")
for _name in ("nq", "triviaqa", "popqa"):
    register(f"singlehop-qa:{_name}", QA_ENTRY_POINT, dataset=_name,
             description=f"{_name} searching the pooled multi-hop corpus unless given corpus= or search=; EM reward")
