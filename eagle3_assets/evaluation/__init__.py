"""Draft evaluation: acceptance of an EAGLE-3 draft, measured in vLLM (online) and simulated from stored hidden states
(offline), for the trained draft and an untrained draft of the same shape.

Modules: ``offline`` (simulation with speculators' own model forward), ``online`` (vLLM spec-decode counters),
``report`` (result dataclasses, report.json / report.md), ``cli`` (``eagle3 evaluate``). Heavy imports (torch,
speculators) happen inside functions only, so importing this package stays cheap.
"""

from eagle3_assets.evaluation.evaluation_report import AcceptanceStats, EvaluationReport, write_report

__all__ = ["AcceptanceStats", "EvaluationReport", "write_report"]
