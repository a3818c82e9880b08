"""Numbers as headfold prints them (verify's budgets and values) and reads them (counts, token ids)."""

from __future__ import annotations

import pytest

from headfold.verification.checks import CheckResult, Gate
from headfold.verification.report import Report


@pytest.mark.parametrize(
    "value, op, budget, percent, shown",
    [
        (0.9999996, ">=", 0.99999, False, ("1", "0.99999")),  # 1 ≥ 0.99999: decided at 4 digits
        (0.999986, ">=", 0.99999, False, ("0.999986", "0.99999")),  # at 4 or 5 digits it would read as the budget or above
        (0.0512, "<=", 0.05, False, ("0.0512", "0.05")),
        (0.999986, ">=", 0.99999, True, ("99.9986%", "99.999%")),
        (1.5019, "<=", 0.05, True, ("150.19%", "5.00%")),
        (0.07, "<=", 0.07, True, ("7.00%", "7.00%")),  # equal, and printed equal
    ],
)
def test_a_gate_prints_the_digits_that_decide_it(value: float, op: str, budget: float, percent: bool, shown: tuple[str, str]) -> None:
    gate = Gate("m", value, op, budget)
    assert gate.shown(percent) == shown
    printed_value = float(shown[0].rstrip("%")) / (100 if percent else 1)
    assert (printed_value >= budget if op == ">=" else printed_value <= budget) == gate.passed  # the printed numbers agree with the verdict


def test_the_table_prints_the_budget_given() -> None:
    check = CheckResult(
        "fidelity", "fidelity", {"runner": "a"}, {"runner": "b"}, {"cosine": 0.9999996}, [Gate("cosine", 0.9999996, ">=", 0.99999)], {"min_cosine": 0.99999}
    )
    rows = Report([check], {}).rows(check)
    assert rows == [("cosine", "1", ">= 0.99999", "PASS")]
