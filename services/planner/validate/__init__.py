"""`splitserve plan validate`: the simulator against the real services on this machine, run by
run (`compare.py`), and whether the planner's pick of configuration measures best
(`ranking.py`)."""
