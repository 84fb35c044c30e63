"""The losses a run can train: what each asks of the settings (``settings.py``), one objective per ``loss_type``
(``registry.py``), and the regularisers that join any of them (``regularisers.py``)."""
