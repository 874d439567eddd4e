"""The ablation's report, ``studies/ablation/README.md``: its figures computed once
(:mod:`~studies.ablation.report.figures`), one template per heading (:mod:`~studies.ablation.report.answer`,
:mod:`~studies.ablation.report.landscape`, :mod:`~studies.ablation.report.depth`,
:mod:`~studies.ablation.report.tables`), the document (:mod:`~studies.ablation.report.render`) and the file
written with its plots (:mod:`~studies.ablation.report.write`)."""
