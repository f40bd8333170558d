"""lightning_v17.planner"""
