"""kvtool.kernels"""
