"""DeepSeek-V4's hyper-connection weights in one launch: `hyper_connections`."""
