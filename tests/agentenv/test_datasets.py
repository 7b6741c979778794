import json
from pathlib import Path

import pytest

from agentenv.datasets import (
    BUILTIN_DATASETS,
    DatasetError,
    Example,
    Paragraph,
    builtin_path,
    detect_format,
    file_format,
    load_examples,
    union_corpus,
)

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.mark.parametrize(
    "name, count, first_answers, paragraphs, supporting",
    [
        ("hotpotqa", 500, ("Chief of Protocol",), 10, 2),
        ("hotpotqa-official", 20, ("Rush",), 10, 2),
        ("2wiki", 164, ("Free Guy",), 10, 4),
        ("musique", 200, ("Stanley",), 20, 2),
        ("bamboogle", 125, ("james madison",), 0, 0),
        ("nq", 1000, ("Jesus Christ",), 0, 0),
        ("triviaqa", 1000, None, 0, 0),
        ("popqa", 1000, ("Ralph Rainger", "Ralph Reichenthal"), 0, 0),
        ("math500", 500, ("\\left( 3, \\frac{\\pi}{2} \\right)",), 0, 0),
        ("gsm8k", 1319, ("18",), 0, 0),
    ],
)
def test_shipped_datasets_load(name, count, first_answers, paragraphs, supporting):
    examples = load_examples(name)
    assert len(examples) == count
    first = examples[0]
    if first_answers is not None:
        assert first.answers == first_answers
    assert len(first.paragraphs) == paragraphs
    assert sum(p.is_supporting for p in first.paragraphs) == supporting


@pytest.mark.skipif(
    not SHARED.is_dir(), reason="../shared/data (the project's data source) is not beside this checkout"
)
def test_shipped_files_are_the_shared_data_unmodified():
    for name in BUILTIN_DATASETS.values():
        assert (Path(__file__).resolve().parents[2] / "agentenv" / "data" / name).read_bytes() == (
            SHARED / name
        ).read_bytes()


def test_hotpotqa_official_paragraphs_join_sentences():
    first = load_examples("hotpotqa-official")[0]
    porcaro = first.paragraphs[0]
    assert porcaro.title == "Jeff Porcaro"
    assert porcaro.text.startswith(
        "Jeffrey Thomas Porcaro (April 1, 1954 – August 5, 1992) was an American drummer, "
        "songwriter, and record producer. In a career"
    )
    assert first.meta == {"type": "bridge", "level": "hard"}


def test_union_corpus_is_deduplicated():
    corpus = union_corpus()
    assert len(corpus) == len({(p.title, p.text) for p in corpus}) == 9490


def _write(tmp_path, name, rows, as_list=False):
    path = tmp_path / name
    path.write_text(json.dumps(rows) if as_list else "\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_formats_are_detected(tmp_path):
    hotpot = {
        "_id": "h1",
        "question": "Q?",
        "answer": "A",
        "supporting_facts": [["T1", 0]],
        "context": [["T1", ["First.", " Second."]], ["T2", ["Other."]]],
    }
    ircot = {
        "question_id": "i1",
        "question_text": "Q?",
        "answers_objects": [{"spans": ["A", "B"]}],
        "contexts": [{"title": "T", "paragraph_text": "P", "is_supporting": True}],
    }
    musique = {
        "id": "m1",
        "question": "Q?",
        "answer": "A",
        "answer_aliases": ["AA"],
        "paragraphs": [{"idx": 0, "title": "T", "paragraph_text": "P", "is_supporting": False}],
    }
    flashrag = {"id": "f1", "question": "Q?", "golden_answers": ["A"]}
    plain = {"question": "Q?", "answers": ["A"]}
    gsm8k = {"question": "Q?", "answer": "2+2=<<2+2=4>>4 apples, 1,000 pears\n#### 1,004"}
    math = {
        "problem": "Q?",
        "answer": "\\frac{1}{2}",
        "solution": "S",
        "subject": "Algebra",
        "level": 2,
        "unique_id": "u",
    }
    assert [detect_format(r) for r in (hotpot, ircot, musique, flashrag, plain, gsm8k, math)] == [
        "hotpotqa",
        "ircot",
        "musique",
        "flashrag",
        "plain",
        "gsm8k",
        "math",
    ]
    assert load_examples(_write(tmp_path, "gsm8k.jsonl", [gsm8k]))[0] == Example(
        "1", "Q?", ("1004",), (), {"solution": "2+2=<<2+2=4>>4 apples, 1,000 pears"}
    )
    assert load_examples(_write(tmp_path, "math.jsonl", [math]))[0] == Example(
        "u", "Q?", ("\\frac{1}{2}",), (), {"solution": "S", "subject": "Algebra", "level": 2}
    )
    # The official HotpotQA file is one JSON list, not JSONL.
    assert load_examples(_write(tmp_path, "hotpot.json", [hotpot], as_list=True)) == [
        Example("h1", "Q?", ("A",), (Paragraph("T1", "First. Second.", True), Paragraph("T2", "Other.", False)), {})
    ]
    assert load_examples(_write(tmp_path, "ircot.jsonl", [ircot]))[0].answers == ("A", "B")
    assert load_examples(_write(tmp_path, "musique.jsonl", [musique]))[0].answers == ("A", "AA")
    assert load_examples(_write(tmp_path, "flashrag.jsonl", [flashrag]))[0] == Example("f1", "Q?", ("A",))
    assert load_examples(_write(tmp_path, "plain.jsonl", [plain, {"question": "R?", "answer": "B"}]))[1] == Example(
        "2", "R?", ("B",)
    )
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": [plain]}, indent=2))
    assert load_examples(wrapped)[0].question == "Q?"


def test_the_format_of_a_file_or_a_shipped_dataset(tmp_path):
    shipped = {name: file_format(name) for name in BUILTIN_DATASETS}
    assert shipped == {
        "hotpotqa": "ircot",
        "hotpotqa-official": "hotpotqa",
        "2wiki": "hotpotqa",
        "musique": "musique",
        "bamboogle": "flashrag",
        "nq": "flashrag",
        "triviaqa": "flashrag",
        "popqa": "flashrag",
        "math500": "math",
        "gsm8k": "gsm8k",
    }
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([{"question": "q?", "answers": ["a"]}]))
    assert file_format(listed) == "plain"
    with pytest.raises(DatasetError, match=r"^no such data file: .*nowhere\.json"):
        file_format(tmp_path / "nowhere.json")
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text('{"prompt": "q?"}\n')
    with pytest.raises(DatasetError, match=r"unknown\.jsonl:1: unrecognised fields \['prompt'\]"):
        file_format(unknown)


def test_bad_rows_name_file_and_line(tmp_path):
    path = _write(tmp_path, "bad.jsonl", [{"question": "Q?", "answers": ["A"]}, {"question": "R?"}])
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: missing field 'answers' \(format detected: plain\)"):
        load_examples(path)
    path = tmp_path / "broken.jsonl"
    path.write_text('{"question": "Q?", "answers": ["A"]}\n{"question": \n')
    with pytest.raises(DatasetError, match=r"broken.jsonl:2: not valid JSON"):
        load_examples(path)
    path = _write(tmp_path, "odd.jsonl", [{"prompt": "Q?"}])
    with pytest.raises(DatasetError, match=r"odd.jsonl:1: unrecognised fields \['prompt'\]"):
        load_examples(path)
    path = _write(tmp_path, "empty_answers.jsonl", [{"question": "Q?", "answers": []}])
    with pytest.raises(DatasetError, match=r"empty_answers.jsonl:1: gold answers must be a non-empty"):
        load_examples(path)
    with pytest.raises(DatasetError, match=r"no such data file: .*missing.jsonl \(shipped datasets: \['2wiki'"):
        load_examples(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="no shipped dataset 'squad'"):
        builtin_path("squad")


@pytest.mark.parametrize("content", ["", " \n\t\n"], ids=["0 bytes", "whitespace"])
def test_an_empty_file_is_called_empty(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    message = f"{path}: the file is empty; expected one JSON object per line (JSONL) or a JSON list"
    with pytest.raises(DatasetError) as e:
        load_examples(path)
    assert str(e.value) == message


# -- 2WikiMultihopQA aliases: 2wikimultihop_evaluate_v1.1.py of Alab-NII/2wikimultihop scores an
# answer against {answer} | aliases | demonyms of the row's answer_id in id_aliases.json.


def _two_wiki_row(_id, answer, answer_id, **extra):
    return {
        "_id": _id,
        "type": "compositional",
        "question": f"Where is {_id}?",
        "answer": answer,
        "answer_id": answer_id,
        "supporting_facts": [["T", 0]],
        "context": [["T", ["Text."]]],
        "evidences": [],
        **extra,
    }


def test_2wiki_alias_file_adds_the_aliases_and_demonyms_of_the_answer_entity(tmp_path):
    from agentenv.graders import exact_match

    data = _write(
        tmp_path,
        "dev.jsonl",
        [
            _two_wiki_row("a", "Montreal, Quebec", "Q340"),
            _two_wiki_row("b", "Lancashire", "Q23077"),  # not in the alias file: its answer alone
            _two_wiki_row("c", "yes", None),  # comparison questions have no answer entity
        ],
    )
    aliases = _write(
        tmp_path,
        "id_aliases.json",
        [
            {"Q_id": "Q340", "aliases": ["Montreal", "Montréal", "Montreal, Quebec"], "demonyms": ["Montrealer"]},
            {"Q_id": "Q5", "aliases": ["human"], "demonyms": []},
        ],
    )
    plain = load_examples(data)
    with_aliases = load_examples(data, aliases=aliases)
    assert [e.answers for e in plain] == [("Montreal, Quebec",), ("Lancashire",), ("yes",)]
    # The answer first, then the aliases and demonyms not already among the golds, in file order.
    assert [e.answers for e in with_aliases] == [
        ("Montreal, Quebec", "Montreal", "Montréal", "Montrealer"),
        ("Lancashire",),
        ("yes",),
    ]
    assert with_aliases[0].meta == {"type": "compositional", "answer_id": "Q340"}
    # Scored against them: "Montréal" is an exact match only with the aliases.
    assert (exact_match("Montréal", plain[0].answers), exact_match("Montréal", with_aliases[0].answers)) == (0.0, 1.0)


def test_the_shipped_2wiki_file_takes_an_alias_file_keyed_by_its_answer_ids(tmp_path):
    first = load_examples("2wiki")[0]
    assert first.meta["answer_id"] == "Q38685497" and first.answers == ("Free Guy",)
    aliases = _write(tmp_path, "id_aliases.json", [{"Q_id": "Q38685497", "aliases": ["Free Guy (film)"]}])
    assert load_examples("2wiki", aliases=aliases)[0].answers == ("Free Guy", "Free Guy (film)")
    assert load_examples("2wiki")[0].answers == ("Free Guy",)  # the cache keeps the two loads apart


def test_the_pooled_multihop_dataset_is_hotpotqa_then_2wiki_then_musique():
    pooled = load_examples("multihop")
    parts = [load_examples(name) for name in ("hotpotqa", "2wiki", "musique")]
    assert [len(part) for part in parts] == [500, 164, 200] and len(pooled) == 864
    assert pooled == parts[0] + parts[1] + parts[2]  # in order: holdout=400 holds out HotpotQA questions only
    with pytest.raises(
        DatasetError, match="aliases= is for one 2WikiMultihopQA file, not the pooled dataset 'multihop'"
    ):
        load_examples("multihop", aliases="id_aliases.json")


def test_2wiki_rows_that_carry_their_aliases_are_scored_against_them(tmp_path):
    rows = [
        _two_wiki_row("a", "New York City", "Q60", answer_aliases=["NYC", "New York City"]),
        _two_wiki_row("b", "France", "Q142", aliases=["French Republic"], demonyms=["French"]),
    ]
    assert [e.answers for e in load_examples(_write(tmp_path, "carried.jsonl", rows))] == [
        ("New York City", "NYC"),
        ("France", "French Republic", "French"),
    ]


def test_bad_alias_input_is_refused_naming_file_line_and_what_is_allowed(tmp_path):
    data = _write(tmp_path, "dev.jsonl", [_two_wiki_row("a", "X", "Q1")])
    bad = _write(tmp_path, "bad.json", [{"Q_id": "Q1", "aliases": ["x"]}, {"aliases": ["y"]}])
    with pytest.raises(DatasetError, match=r"bad.json:2: missing field 'Q_id' \(an alias row is"):
        load_examples(data, aliases=bad)
    bad = _write(tmp_path, "bad2.json", [{"Q_id": "Q1", "aliases": "x"}])
    with pytest.raises(DatasetError, match=r"bad2.json:1: 'aliases' must be a list of strings, got 'x'"):
        load_examples(data, aliases=bad)
    with pytest.raises(DatasetError, match=r"no such alias file: .*missing.json \(2WikiMultihopQA's id_aliases.json\)"):
        load_examples(data, aliases=tmp_path / "missing.json")
    good = _write(tmp_path, "good.json", [{"Q_id": "Q1", "aliases": ["x"]}])
    with pytest.raises(
        DatasetError, match=r"good.json: an alias file is keyed by 2WikiMultihopQA's answer_id, and no row"
    ):
        load_examples("musique", aliases=good)


# -- MuSiQue-Full: evaluate_v1.0.py of StonyBrookNLP/musique scores answers on answerable rows only;
# an unanswerable row (answerable: false, the id of its answerable twin) counts in the answerability metric.


def _musique_row(answerable, question="Who is Q?"):
    return {
        "id": "2hop__1_2",
        "question": question,
        "answer": "A",
        "answer_aliases": ["AA"],
        "answerable": answerable,
        "paragraphs": [{"idx": 0, "title": "T", "paragraph_text": "P", "is_supporting": answerable}],
    }


def test_musique_full_unanswerable_rows_are_skipped_by_default(tmp_path):
    path = _write(tmp_path, "full.jsonl", [_musique_row(True), _musique_row(False)])
    (only,) = load_examples(path)
    assert (only.id, only.answers, only.meta) == ("2hop__1_2", ("A", "AA"), {"answerable": True})
    with pytest.raises(DatasetError, match=r"no examples \(1 unanswerable rows skipped; pass unanswerable='include'"):
        load_examples(_write(tmp_path, "unanswerable.jsonl", [_musique_row(False)]))


def test_musique_full_unanswerable_rows_included_are_posed_with_the_unanswerable_gold(tmp_path):
    from agentenv.datasets import UNANSWERABLE

    path = _write(tmp_path, "full.jsonl", [_musique_row(True), _musique_row(False)])
    answerable, unanswerable = load_examples(path, unanswerable="include")
    assert answerable.meta == {"answerable": True} and answerable.answers == ("A", "AA")
    # Never posed as an ordinary question: its twin's answer is not its gold.
    assert UNANSWERABLE == "unanswerable"
    assert (unanswerable.id, unanswerable.answers) == ("2hop__1_2", ("unanswerable",))
    assert unanswerable.meta == {"answerable": False, "answers_if_answerable": ("A", "AA")}
    assert unanswerable.paragraphs == (Paragraph("T", "P", False),)


def test_the_shipped_musique_ans_rows_are_flagged_answerable():
    assert {e.meta["answerable"] for e in load_examples("musique")} == {True}


def test_bad_unanswerable_input_is_refused(tmp_path):
    path = _write(tmp_path, "full.jsonl", [_musique_row(True)])
    with pytest.raises(ValueError, match="unanswerable must be one of 'skip', 'include', got 'grade'"):
        load_examples(path, unanswerable="grade")
    bad = _write(tmp_path, "bad.jsonl", [{**_musique_row(True), "answerable": "no"}])
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: 'answerable' must be true or false, got 'no'"):
        load_examples(bad)


def test_qa_envs_pass_aliases_and_unanswerable_rows_to_the_loader(tmp_path):
    import agentenv
    from agentenv.envs.qa import UNANSWERABLE_NOTE

    text = [{"idx": 0, "title": "Tokyo", "paragraph_text": "Tokyo is the capital of Japan.", "is_supporting": True}]
    rows = [{**_musique_row(answerable), "paragraphs": text} for answerable in (True, False)]
    path = _write(tmp_path, "full.jsonl", rows)
    skipped = agentenv.make("multihop-qa", data=path)
    assert len(skipped.tasks) == 1 and UNANSWERABLE_NOTE not in skipped.reset(options={"index": 0})[0]
    env = agentenv.make("multihop-qa", data=path, unanswerable="include")
    prompt, info = env.reset(options={"index": 1})
    assert info["answers"] == ["unanswerable"] and f"Who is Q?{UNANSWERABLE_NOTE}\n" in prompt
    assert env.step("<answer>\\boxed{unanswerable}</answer>")[1] == 1.0  # the em reward: the right answer
    data = _write(tmp_path, "2wiki.json", [_two_wiki_row("a", "Montreal", "Q340")], as_list=True)
    aliases = _write(tmp_path, "id_aliases.json", [{"Q_id": "Q340", "aliases": ["Montréal"], "demonyms": []}])
    web = agentenv.make("web-research", data=data, aliases=aliases)
    assert web.tasks[0].answers == ("Montreal", "Montréal")
