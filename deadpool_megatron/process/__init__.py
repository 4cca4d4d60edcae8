"""What runs inside a worker or spare process: start-up, the training loop's protection and
failure reporting, the order watcher, and the hand-off to the recovery."""
