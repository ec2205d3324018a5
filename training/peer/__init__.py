"""`ttt train`: one volunteer's peer (training/peer/join.py: the join, step by step; training/peer/loop.py: the loop
and its collaborators)."""
