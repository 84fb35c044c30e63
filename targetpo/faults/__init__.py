"""What a run does when something beneath it fails: a checkpoint write that fails part-way (``checkpoints.py``), a
training process lost (``lost_processes.py``). A generation server that stops answering is the rollout backend's to
notice (``generation/server_liveness.py``)."""
