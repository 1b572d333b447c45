"""What turns drafts into output losslessly: the target's sampling transform, the acceptance rules for
chains and token trees, and the tree layout both ends share."""
