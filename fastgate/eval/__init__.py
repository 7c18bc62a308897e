"""Evaluation: QA sets (``datasets``), metrics (``metrics``), the resumable runner (``runner``), its reports
(``report``), the gates' quality against a coin (``gate_quality``) and the papers' reference pipeline (``baseline``).
Import the submodules; the package itself exports nothing."""

__all__: list[str] = []
