"""lightning_v17.optim"""
