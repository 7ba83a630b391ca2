"""TF-Privacy / Keras adapter, installed as ``hidden_state_accountants.tf_privacy``."""
