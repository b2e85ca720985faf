"""What speculation is made of, whatever drafts: draft trees and their shapes (trees), what
verifying and drafting cost on this machine (cost_model), and the adaptive policy that sizes
each step's trees from both (policy; drafters see it only as a trees.TreeSizer)."""
