"""The dispatcher: a Ray driver that turns a spec into one task per attempt and lands every result."""
