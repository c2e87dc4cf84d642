#!/usr/bin/env python3
"""Writes a big trace DB in msMemScope's memscope_dump layout (tests only): PAIRS device blocks
allocated and freed on device 0, one MALLOC and one FREE row each, a START_TRACE and STOP_TRACE
around them. For tests of long offline work (progress bars); the layout is the one MindStudio
Insight reads, written here with Python's own sqlite3, not by the tracer.

Usage: big_db.py PATH PAIRS
"""

import sqlite3
import sys


def main():
    path, pairs = sys.argv[1], int(sys.argv[2])
    db = sqlite3.connect(path)
    db.execute('CREATE TABLE memscope_dump ("ID" INTEGER, "Event" TEXT, "Event Type" TEXT, "Name" TEXT, '
               '"Timestamp(ns)" INTEGER, "Process Id" INTEGER, "Thread Id" INTEGER, "Device Id" TEXT, '
               '"Ptr" TEXT, "Attr" TEXT, "Call Stack(Python)" TEXT, "Call Stack(C)" TEXT)')
    t0 = 1_767_225_600_000_000_000

    def rows():
        yield (1, "SYSTEM", "START_TRACE", "", t0, 1, 1, "0", "N/A", '{"tool":"big_db"}', "", "")
        for i in range(pairs):
            ptr = 0x100000000 + (i % 4096) * 0x10000
            attr = '{"addr":"0x%x","size":"4096","allocation_id":"%d"}' % (ptr, i + 1)
            ts = t0 + 10 * i
            yield (2 * i + 2, "MALLOC", "HAL", "", ts + 1, 1, 1, "0", "0x%x" % ptr, attr, "", "")
            yield (2 * i + 3, "FREE", "HAL", "", ts + 5, 1, 1, "0", "0x%x" % ptr, attr, "", "")
        end = t0 + 10 * pairs + 10
        yield (2 * pairs + 2, "SYSTEM", "STOP_TRACE", "", end, 1, 1, "0", "N/A", '{"tool":"big_db"}', "", "")

    db.executemany("INSERT INTO memscope_dump VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows())
    db.commit()


if __name__ == "__main__":
    main()
