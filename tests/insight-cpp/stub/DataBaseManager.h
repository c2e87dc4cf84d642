// Stand-in for Insight's DataBaseManager.h: see insight_stubs.h. Insight's own header brings
// the MemScope database's declarations with it, which the memscope sources rely on.
#pragma once
#include "insight_stubs.h"
#include "MemScopeDatabase.h"
