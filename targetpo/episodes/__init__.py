"""Multi-turn episodes: tools and the chat template between turns (``tools.py``), environments and the loop of turns
(``multi_turn.py``)."""
