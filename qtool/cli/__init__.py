"""Command-line interface: one module per command (flags -> op -> report); no logic here."""
