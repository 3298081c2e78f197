"""Only `@triton.jit` code lives here; launchers beside this package validate and launch."""
