"""(filled in by later issues)"""
