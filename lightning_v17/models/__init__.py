"""lightning_v17.models"""
