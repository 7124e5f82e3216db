// The native op's one translation unit (setup.py builds this file only). The ops live in the
// files below, one concern each (disk_ops.cpp: the disk tier's row file; optimizer_ops.cpp:
// the updates a table runs itself); they are compiled as
// one unit because as three, the id map's inserts ran 15-18% slower (A/B in one process, same
// compiler flags: 10M keys, 163,840 ids of which 20% new; as one unit the split code is as fast
// as the single file it came from).
#include "row_ops.cpp"
#include "id_map_ops.cpp"
#include "checkpoint_ops.cpp"
#include "disk_ops.cpp"
#include "optimizer_ops.cpp"
