"""What several test folders need: repository paths, .env.example, free ports, helper processes."""
