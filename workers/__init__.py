"""The worker server: hosts a target model and speaks protocol v1 (DESIGN §4)."""
