// memscope-bpf's stand-in for Insight's SQLite base class (`Dic::Module::Database`): open,
// run SQL, look tables and columns up, and keep Insight's parse status in `status_info`.
#include "insight_stubs.h"

namespace Dic::Module {
namespace {
const std::string VERSION_KEY = "harness_db_version";
const std::string VERSION = "memscope-bpf-harness-1";

// The first column of the first row of `sql`, with `binds` bound from 1.
std::optional<std::string> QueryOne(sqlite3* db, const std::string& sql, const std::vector<std::string>& binds = {})
{
    sqlite3_stmt* stmt = nullptr;
    if (db == nullptr || sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) != SQLITE_OK) {
        return std::nullopt;
    }
    for (size_t i = 0; i < binds.size(); ++i) {
        sqlite3_bind_text(stmt, static_cast<int>(i + 1), binds[i].c_str(), -1, SQLITE_TRANSIENT);
    }
    std::optional<std::string> out;
    if (sqlite3_step(stmt) == SQLITE_ROW) {
        const unsigned char* text = sqlite3_column_text(stmt, 0);
        out = text == nullptr ? "" : reinterpret_cast<const char*>(text);
    }
    sqlite3_finalize(stmt);
    return out;
}
}  // namespace

bool Database::OpenDb(const std::string& dbPath, bool)
{
    if (isOpen) {
        return true;
    }
    if (sqlite3_open_v2(dbPath.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_FULLMUTEX, nullptr) != SQLITE_OK) {
        Server::ServerLog::Error("open ", dbPath, ": ", db ? sqlite3_errmsg(db) : "no memory");
        sqlite3_close(db);
        db = nullptr;
        return false;
    }
    path = dbPath;
    isOpen = true;
    return true;
}

void Database::CloseDb()
{
    if (db != nullptr) {
        sqlite3_close_v2(db);
        db = nullptr;
    }
    isOpen = false;
}

bool Database::ExecSql(const std::string& sql) const
{
    char* err = nullptr;
    if (sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
        Server::ServerLog::Error("exec failed: ", err ? err : "?", " sql: ", sql);
        sqlite3_free(err);
        return false;
    }
    return true;
}

bool Database::CheckTableExist(const std::string& table)
{
    return QueryOne(db, "SELECT name FROM sqlite_master WHERE type='table' AND name=?", {table}).has_value();
}

bool Database::CheckTablesExist(const std::vector<std::string>& tables)
{
    return std::all_of(tables.begin(), tables.end(), [this](const std::string& t) { return CheckTableExist(t); });
}

bool Database::CheckColumnExist(const std::string& table, const std::string& column)
{
    return QueryOne(db, "SELECT name FROM pragma_table_info(?) WHERE name=?", {table, column}).has_value();
}

bool Database::IsDatabaseVersionChange() const
{
    auto v = QueryOne(db, "SELECT value FROM " + infoTable + " WHERE key=?", {VERSION_KEY});
    return !v.has_value() || *v != VERSION;
}

bool Database::SetDataBaseVersion(const std::string& targetVersion)
{
    return UpdateValueIntoStatusInfoTable(VERSION_KEY, targetVersion.empty() ? VERSION : targetVersion);
}

bool Database::CheckValueFromStatusInfoTable(const std::string& key, const std::string& refValue)
{
    auto v = QueryOne(db, "SELECT value FROM " + infoTable + " WHERE key=?", {key});
    return v.has_value() && *v == refValue;
}

bool Database::UpdateValueIntoStatusInfoTable(const std::string& key, const std::string& value)
{
    std::unique_lock<std::recursive_mutex> lock(mutex);
    if (!ExecSql("CREATE TABLE IF NOT EXISTS " + infoTable + " (key TEXT PRIMARY KEY, value TEXT)")) {
        return false;
    }
    sqlite3_stmt* stmt = nullptr;
    std::string sql = "INSERT OR REPLACE INTO " + infoTable + " (key, value) VALUES (?, ?)";
    if (sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) != SQLITE_OK) {
        return false;
    }
    sqlite3_bind_text(stmt, 1, key.c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_text(stmt, 2, value.c_str(), -1, SQLITE_TRANSIENT);
    bool ok = sqlite3_step(stmt) == SQLITE_DONE;
    sqlite3_finalize(stmt);
    return ok;
}

std::string Database::sqlite3_column_string(sqlite3_stmt* stmt, int col)
{
    const unsigned char* text = ::sqlite3_column_text(stmt, col);
    return text == nullptr ? "" : reinterpret_cast<const char*>(text);
}

// Table filtering, ordering and paging (the memory-block and event tables; not the trace).
std::string Database::BuildQueryFiltersConditionSql(const std::map<std::string, std::string>& filters)
{
    std::string sql;
    for (const auto& f : filters) {
        sql += " AND " + f.first + " LIKE ? ";
    }
    return sql;
}

std::string Database::BuildQueryRangeFiltersConditionSql(
    const std::map<std::string, std::pair<double, double>>& rangeFilters)
{
    std::string sql;
    for (const auto& f : rangeFilters) {
        sql += " AND " + f.first + " BETWEEN ? AND ? ";
    }
    return sql;
}

std::string Database::BuildQueryOrderSql(const std::string& orderBy, bool desc)
{
    return " ORDER BY " + orderBy + (desc ? " DESC " : " ASC ");
}

void Database::CommonBindFiltersParams(const std::map<std::string, std::string>& filters, sqlite3_stmt* stmt,
                                       int& bindIdx)
{
    for (const auto& f : filters) {
        std::string pattern = "%" + f.second + "%";
        sqlite3_bind_text(stmt, bindIdx++, pattern.c_str(), -1, SQLITE_TRANSIENT);
    }
}

void Database::CommonBindRangeFiltersParams(const std::map<std::string, std::pair<double, double>>& rangeFilters,
                                            sqlite3_stmt* stmt, int& bindIdx)
{
    for (const auto& f : rangeFilters) {
        sqlite3_bind_double(stmt, bindIdx++, f.second.first);
        sqlite3_bind_double(stmt, bindIdx++, f.second.second);
    }
}

void Database::CommonBindPaginationParams(int64_t pageSize, int64_t currentPage, sqlite3_stmt* stmt, int& bindIdx)
{
    bool all = pageSize <= 0 || currentPage <= 0;
    sqlite3_bind_int64(stmt, bindIdx++, all ? -1 : pageSize);
    sqlite3_bind_int64(stmt, bindIdx++, all ? 0 : (currentPage - 1) * pageSize);
}
}  // namespace Dic::Module
