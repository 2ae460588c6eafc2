"""The `magicdec` commands, one module each with `run(args)`; `magicdec.cli` imports only the chosen one."""
