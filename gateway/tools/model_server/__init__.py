"""The simulated GPU model server: few slots, an unbounded FIFO behind them, no admission control."""
