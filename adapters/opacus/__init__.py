"""Opacus / PyTorch adapter, installed as ``hidden_state_accountants.opacus``."""
