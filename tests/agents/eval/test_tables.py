"""The plain-text table of the evaluation, held-out and benchmark results."""

from agents.eval.tables import text_table


def test_columns_are_as_wide_as_their_widest_cell_the_first_left_aligned():
    assert text_table(["env", "EM %"], [["nq", "41.20"], ["hotpotqa", "7.5"]]).splitlines() == [
        "env        EM %",
        "--------  -----",
        "nq        41.20",
        "hotpotqa    7.5",
    ]
