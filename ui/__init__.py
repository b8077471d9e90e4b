"""One module per tab: build_<tab>() lays out components and wires handlers. No algorithm here."""
