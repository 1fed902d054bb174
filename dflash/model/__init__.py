"""The models: the frozen target, the DFlash drafter, and the mask / anchors / loss."""
