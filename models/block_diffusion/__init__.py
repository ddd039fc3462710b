"""The block-diffusion draft backbone shared by DFlash2 and DSpark: layers, masks, the draft base class,
the spec pieces and the decode-time block decoder."""
