"""kvtool.viz"""
