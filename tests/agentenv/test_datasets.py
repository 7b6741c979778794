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
