"""Where training rows come from: chat files, the packaged ShareGPT, synthetic rows."""
