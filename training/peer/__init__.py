"""`ttt train`: one volunteer's peer (training/peer/loop.py describes the loop and its collaborators)."""
