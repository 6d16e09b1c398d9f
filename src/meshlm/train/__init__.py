"""Training: trainer loop, optimizer and schedule, precision, metrics and progress."""
