"""Multi-turn episodes: tools and how their calls run (``tools.py``, ``async_runner.py``), the chat template between
turns (``chat_template.py``), environments (``environments.py``) and the loop of turns (``multi_turn.py``)."""
