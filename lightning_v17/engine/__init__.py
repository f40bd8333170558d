"""lightning_v17.engine"""
