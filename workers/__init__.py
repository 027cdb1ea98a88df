"""The worker server: hosts a target model and speaks protocol v1 (docs/design.md §4)."""
