"""lightning_v17.data"""
